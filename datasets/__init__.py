"""The DSpark paper's five eval prompt sets as `{"turns": [...]}` lines (copied from the steering repo's
shared/datasets; see README.md here). Package data, so an installed specrt has them too."""
from pathlib import Path

DATASETS_DIR = Path(__file__).resolve().parent
