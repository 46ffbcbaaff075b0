"""Text in and out of the model: chat templates, prompts, incremental detokenizing, token bytes."""
