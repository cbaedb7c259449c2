"""``shoestring evaluate``: lm-evaluation-harness tasks on a model streamed layer by layer.

lm-eval's requests become inference jobs (:mod:`shoestring.infer`): every
``loglikelihood`` call one score-mode job, every ``generate_until`` call one
generate-mode job, in run directories named by a hash of their requests, so a
rerun of the same command after a kill resumes the job that was interrupted.
"""
