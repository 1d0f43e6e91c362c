"""Golden gates: golden files of the tiny trained models and the gate that judges a loaded model against them."""
