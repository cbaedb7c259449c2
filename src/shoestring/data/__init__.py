"""Training and evaluation data shared by the trainer and batch inference.

``records`` (the shared types), ``formats`` (JSON objects → records, per format),
``sources`` (where records come from: files, folders, datasets, fsspec URLs),
``chat`` / ``tokenize`` (records → token ids and labels), ``packing`` (best-fit
packing without cross-sample attention) and ``cache`` (the memory-mapped,
content-addressed tokenized cache). This package imports only the spine.
"""
