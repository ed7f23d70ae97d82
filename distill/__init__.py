"""Distillation of draft heads (DSpark, MTP) from a target's own outputs; kept out of the runtime."""
