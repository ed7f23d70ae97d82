"""Draft-head plugins (ConfidenceTruncate) arrive with the DSpark scheduling work."""
