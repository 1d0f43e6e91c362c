"""Where the project's data lives: cases/, golden/, models/ beside the package (one place to say so)."""

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CASES_DIR = PROJECT_ROOT / "cases"
GOLDEN_DIR = PROJECT_ROOT / "golden"
MODELS_DIR = PROJECT_ROOT / "models"
