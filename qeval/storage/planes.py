"""A row of uint16 codes as a store keeps it (docs/store-format.md): its two byte planes; the code's size and the ids
kept per row. Shared by the store and the codec, which codes rows without knowing stores."""

from __future__ import annotations

import numpy as np

N_CODES = 65536
TOP_K = 10


def codes_to_planes(codes: np.ndarray) -> np.ndarray:
    """uint16 [b, n_vocab] -> uint8 [b, 2, n_vocab] (high bytes, then low bytes): zstd packs planes far better."""
    codes = np.asarray(codes, dtype=np.uint16)
    planes = np.empty((codes.shape[0], 2, codes.shape[1]), dtype=np.uint8)
    np.right_shift(codes, 8, out=planes[:, 0, :], casting="unsafe")
    np.bitwise_and(codes, 0xFF, out=planes[:, 1, :], casting="unsafe")
    return planes


def planes_to_codes(planes: np.ndarray) -> np.ndarray:
    return (planes[:, 0, :].astype(np.uint16) << 8) | planes[:, 1, :]
