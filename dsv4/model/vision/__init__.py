"""Vision inputs of DeepSeek-V4-Flash-Vision (docs/vision.md): image grids and the image
block layout (`grid.py`), Pillow preprocessing (`preprocess.py`), the tower, aligner and
sentinels (`tower.py`), their plain reference (`reference.py`), image spans of a prompt and
the engine rules about them (`spans.py`), and the engine's encoder with its cache
(`encoder.py`)."""
