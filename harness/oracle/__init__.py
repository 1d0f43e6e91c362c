"""The oracle: the reference dequantizer, written from the formats' definitions, independent of every engine."""
