"""Files and flags <-> spec: job files, presets, Hugging Face configs, overrides."""
