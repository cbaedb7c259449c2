"""Layer-streaming batch inference: ``shoestring infer``.

Runs a Hugging Face decoder model that does not fit in memory by streaming its
layers from the original safetensors shards, one layer at a time, for the whole
job's batch at once (so each layer is read once per decode step, not once per
sequence). See ``docs/inference.md``.
"""
