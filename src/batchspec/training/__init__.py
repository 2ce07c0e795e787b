"""Training drafts for a target (``batchspec train-draft``): from a prompt set to a folder ``batchspec.LLM`` loads.

``prompts``: the generated training prompt sets; ``data``: the gen stage of a feature-reading head (the target's
answers and features, in resumable chunks) and the helpers that read them back; ``head``: the head's build, forwards,
loss, train and export stages; ``draft_model``: the small draft model's gen, build, train and export stages. Measuring
a trained draft is ``scripts/eval_draft.py``'s job.
"""
