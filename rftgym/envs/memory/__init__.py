"""Memory-editable long-horizon QA (after Memory-as-Action): the MemoryQA environment, its task
builders, context budget and the pure context operations (search results, prunes, memory notes)."""
