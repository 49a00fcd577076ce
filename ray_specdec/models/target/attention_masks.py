"""Attention masks for the target's forwards: a verify's tree mask (every cached key, the tree's ancestors), kept per
tree shape as views of one buffer (`TreeMasks`); a prefill chunk's causal mask; and, off the CPU, the layout sdpa's
memory-efficient kernel reads without copying a mask again at every call (`aligned_mask`)."""

from __future__ import annotations

import torch

from ray_specdec.speculation.tree import TreeTensors

# Cached tokens the first mask buffer of a tree shape covers (TreeMasks; it doubles as longer caches come).
MASK_MIN_WIDTH = 512
# Row stride (elements) of the masks handed to sdpa off the CPU: the memory-efficient kernel's alignment (aligned_mask).
MASK_ALIGNMENT = 16


class TreeMasks:
    """`tree_attention_mask`s as views of one buffer per tree shape, so a verify's mask costs a slice, not a build.

    Whether a verify row sees a key depends on the key's offset from the cache's end only (every cached key, or those
    within the window of the row's position; the tree's own columns), so one buffer built for `width` cached tokens
    holds the mask of every shorter cache: the view that starts `width - cache_len` columns in. A buffer is rebuilt
    twice as wide when a longer cache comes; at most `shapes` tree shapes are kept (the oldest goes first)."""

    def __init__(self, dtype: torch.dtype, device: torch.device, window: int | None, shapes: int = 32,
                 aligned: bool | None = None):
        """aligned: hand out copies laid out as sdpa's memory-efficient kernel reads them (`aligned_mask`); None:
        on for devices other than the CPU (the native and CPU kernels take any row stride)."""
        self.dtype, self.device, self.window, self.shapes = dtype, device, window, shapes
        self.aligned = device.type != "cpu" if aligned is None else aligned
        self._buffers: dict[tuple, tuple[int, torch.Tensor]] = {}  # tree paths -> (width, [1, 1, S, width + S])

    def __call__(self, cache_len: int, tree: TreeTensors) -> torch.Tensor:
        """tree_attention_mask(cache_len, tree, ...): [1, 1, S, cache_len + S] (a view with row stride width + S)."""
        width, buffer = self._buffers.get(tree.paths, (-1, None))
        if width < cache_len:
            width = max(cache_len, 2 * width, MASK_MIN_WIDTH)
            buffer = tree_attention_mask(width, tree, self.dtype, self.device, self.window)
            self._buffers.pop(tree.paths, None)
            if len(self._buffers) >= self.shapes:
                del self._buffers[next(iter(self._buffers))]
            self._buffers[tree.paths] = (width, buffer)
        mask = buffer[..., width - cache_len :]
        return aligned_mask(mask) if self.aligned else mask

    def place(self, mask: torch.Tensor) -> torch.Tensor:
        """Another mask (built on the CPU) on this device, laid out as this object's masks are."""
        mask = mask.to(self.device)
        return aligned_mask(mask) if self.aligned and mask.is_floating_point() else mask


def aligned_mask(mask: torch.Tensor) -> torch.Tensor:
    """A copy of an additive mask [..., L] whose rows start at multiples of MASK_ALIGNMENT elements, in a buffer of its
    own (a view of its first L columns). sdpa's memory-efficient kernel needs that layout: given any other, torch pads
    and copies the mask again at every call, i.e. for every layer of every request (on an H200, ~30 us of host time
    and two kernel launches each: 16% of a 7B-sized model's step at 32 requests)."""
    width = mask.shape[-1]
    padded = mask.new_empty(*mask.shape[:-1], -(-width // MASK_ALIGNMENT) * MASK_ALIGNMENT)[..., :width]
    return padded.copy_(mask)


def prefill_mask(cache_len: int, rows: int, window: int | None, additive: torch.dtype | None) -> torch.Tensor | None:
    """The mask HF builds for a prefill chunk of `rows` after `cache_len` cached tokens: None where attention needs
    none (one row, or sdpa's causal flag without a cache; full attention); else [1, 1, rows, cache_len + rows], bool
    (True: attend) or, for eager attention (additive = the model's dtype), 0 / the dtype's min."""
    if window is None and (rows == 1 or (cache_len == 0 and additive is None)):
        return None
    q_pos = torch.arange(cache_len, cache_len + rows)[:, None]
    k_pos = torch.arange(cache_len + rows)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= (q_pos - k_pos) < window
    if additive is not None:
        return torch.zeros(visible.shape, dtype=additive).masked_fill_(~visible, torch.finfo(additive).min)[None, None]
    return visible[None, None]


def tree_attention_mask(
    cache_len: int, tree: TreeTensors, dtype: torch.dtype, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """Additive mask [1, 1, 1 + n, cache_len + 1 + n]: 0 where a verify row may attend, dtype's min elsewhere.

    Every row sees the whole cache and its tree ancestors and itself; with a sliding window, only keys whose position
    is within `window` of the row's position. (Forwards take `TreeMasks`' views of these.)
    """
    rows = 1 + tree.num_nodes
    visible = torch.cat([torch.ones(rows, cache_len, dtype=torch.bool), tree.attn_mask], dim=1)
    if window is not None:
        q_pos = tree.position_ids(cache_len)
        k_pos = torch.cat([torch.arange(cache_len), q_pos])
        visible &= (q_pos[:, None] - k_pos[None, :]) < window
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.to(device)[None, None]
