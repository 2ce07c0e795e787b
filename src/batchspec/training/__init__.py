"""Training drafts for a target: the feature-reading head and the small draft model, from prompt sets to a folder `batchspec.LLM` loads."""
