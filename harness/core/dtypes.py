"""The model dtypes a checkpoint may declare, by their config.json names."""

import torch

MODEL_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
