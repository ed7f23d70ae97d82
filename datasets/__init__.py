"""The DSpark paper's five eval prompt sets as `{"turns": [...]}` lines (DeepSpec's eval_datasets; README.md here
names the public benchmark each samples and its licence). Package data, so an installed specrt has them too."""
from pathlib import Path

DATASETS_DIR = Path(__file__).resolve().parent
