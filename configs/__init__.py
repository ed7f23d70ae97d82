"""Model presets and engine profiles."""
