"""The short-convolution residual update: ``residual + (y + conv(y))``, where ``y`` is the
producer's complete output and ``conv`` a causal channelwise (depthwise) convolution along
each request's tokens (Inkling's ``attn_sconv``/``mlp_sconv``; transformers'
``InklingShortConvolution``, which keeps its weight and its arithmetic in fp32).

The update is deferred: the consumer completes the producer's sum, convolves it, adds it to
the residual and reads its input through its own norm. What it supports, declared here and
nowhere inherited:

- not ``plain``: the convolution mixes a channel over a request's earlier tokens, so it never
  moves before the producer's sum and no fused add+norm candidate stands in for it;
- not ``portable``: it holds its layer's weights and its requests' windows, so a declared
  partial sum may not cross a pipeline cut with it pending (``to_pp`` refuses by name);
- not per token: it needs each DP rank's complete output on that rank's own token rows, in
  token order. It declares so (``token_rows``), and the consumer's path is built to complete
  the producer's output onto those rows (the local rows) and apply the update there in every
  row mode: under ``rs``/``rsv`` the sum lands on the DP rank's rows (an all-reduce, or a
  reduce-scatter then a gather), the residual is gathered to them, and the next entry moves
  it back to its scattered slice; a convolution given other rows raises
  ``SHORT_CONV_ROWS``;
- its decode state (each request's last ``kernel - 1`` outputs) lives in the model's cache,
  ``forward_batch.kv_cache.short_conv`` (a ``ShortConvState``), keyed by the update's name;
- it reads the forward's requests, and declares so (``reads_batch``): whoever applies it hands
  it the forward batch it runs in (a consumer's input; ``residual.batch``'s fold, final norm
  and ``to_pp``, which fold it in on the DP rank's own rows where the stack or a pipeline
  stage leaves, whichever layer is last);
- an empty DP rank has no rows and no requests: nothing to convolve;
- a snapshot refuses it (``snapshot requires a plain residual update``); a capture sees the
  residual it leaves.
"""

from __future__ import annotations

import torch
from torch import nn

from ..runtime.arguments import positive_int
from .add_norm import accumulate_dtype

SHORT_CONV_ROWS = "short convolution needs its original token rows"
NO_FORWARD = ("a short-convolution update is applied in a forward batch, and none was handed: "
              "apply it with residual.apply_update(update, residual, contribution, forward)")


class ShortConvState:
    """Per request slot and convolution (``key``): its last ``kernel - 1`` inputs, fp32
    [slots, kernel - 1, channels], zeros until a prompt writes them.

    Args:
        slots: request slots (positive).
        channels: each convolution's key -> its channels (positive).
        kernel: the convolutions' taps (positive; 1 keeps no window).
        device: where the windows live.
    """

    def __init__(self, slots: int, channels: dict, kernel: int, device="cpu") -> None:
        slots = positive_int("ShortConvState", "slots", slots)
        kernel = positive_int("ShortConvState", "kernel", kernel)
        if not isinstance(channels, dict):
            raise TypeError(f"ShortConvState(channels={channels!r}): channels must map each "
                            "convolution's key to its channels")
        for key, c in channels.items():
            positive_int("ShortConvState", f"channels[{key!r}]", c)
        self.kernel = kernel
        self.windows = {key: torch.zeros((slots, kernel - 1, c), dtype=torch.float32,
                                         device=device) for key, c in channels.items()}

    def __getitem__(self, key: str) -> torch.Tensor:
        window = self.windows.get(key)
        if window is None:
            raise KeyError(f"the cache holds no short-convolution state for {key}")
        return window

    def snapshot(self) -> dict:
        return {key: t.clone() for key, t in self.windows.items()}

    def restore(self, saved: dict) -> None:
        """Put back what ``snapshot`` returned (the same keys and shapes)."""
        for key, t in saved.items():
            if key not in self.windows or not isinstance(t, torch.Tensor) or (
                    t.shape != self.windows[key].shape):
                raise ValueError(f"a short-convolution snapshot holds {key!r} "
                                 f"{_shape(t)}; this state keeps "
                                 f"{_shape(self.windows.get(key))}")
        for key, t in saved.items():
            self.windows[key].copy_(t)


def state_of(forward_batch, key: str) -> torch.Tensor:
    """Convolution ``key``'s windows in the batch's cache."""
    store = getattr(forward_batch.kv_cache, "short_conv", None)
    if store is None:
        raise RuntimeError(f"{key}: the batch's cache keeps no short-convolution state "
                           "(kv_cache.short_conv, a ShortConvState)")
    return store[key]


class ShortConv(nn.Module):
    """``x + conv(x)``: the causal depthwise convolution of ``channels`` channels over each
    request's tokens, in fp32 (``conv1d.weight`` [channels, 1, kernel], fp32 whatever the
    model's dtype, as transformers keeps it), the result in ``x``'s dtype.

    Args:
        channels: the channels convolved (positive).
        kernel: its taps along the tokens (positive, as config.json's ``conv_kernel_size``):
            each row sees itself and its request's ``kernel - 1`` rows before it.
    """

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        channels = positive_int("ShortConv", "channels", channels)
        self.kernel = positive_int("ShortConv", "kernel", kernel)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=torch.float32),
                                          requires_grad=False)

    def forward(self, x: torch.Tensor, window: torch.Tensor, forward_batch) -> torch.Tensor:
        """x: [T, C], the batch's requests concatenated in token order; ``window``: the
        state [slots, kernel - 1, C] each request continues from (where it has a prefix)
        and leaves its last inputs in."""
        self._check(x, window, forward_batch)
        if x.shape[0] == 0:
            return x
        if x.shape[0] != forward_batch.num_tokens:
            raise ValueError(f"a short convolution got {x.shape[0]} rows; the batch holds "
                             f"{forward_batch.num_tokens} tokens ({SHORT_CONV_ROWS})")
        x32 = x.float()
        if forward_batch.decode_step:  # one call convolves every request's one token
            conv = self._decode(x32, window, forward_batch)
        else:
            conv = torch.cat([self._request(x32[r.start:r.end], window, r.slot, r.prefix)
                              for r in forward_batch.requests()])
        return (x32 + conv).to(dtype=x.dtype)

    def _check(self, x, window, forward_batch) -> None:
        """``x`` of this convolution's channels, and a state of its kernel and channels
        holding every slot the batch names, before anything is read or written."""
        channels = self.conv1d.weight.shape[0]
        said = f"ShortConv(channels={channels}, kernel={self.kernel})"
        if x.dim() != 2 or x.shape[1] != channels:
            raise ValueError(f"{said} got an input of shape {tuple(x.shape)}; it convolves "
                             f"[tokens, {channels}]")
        slots = max(forward_batch.req_slots, default=-1) + 1
        if not (isinstance(window, torch.Tensor) and window.dim() == 3
                and window.shape[1:] == (self.kernel - 1, channels)
                and window.dtype == torch.float32 and window.shape[0] >= slots):
            raise ValueError(f"{said} got a state {_shape(window)}; it keeps fp32 [slots, "
                             f"{self.kernel - 1}, {channels}] (each request's last kernel - 1 "
                             f"inputs), for slots up to {slots - 1}")

    def _taps(self) -> torch.Tensor:
        return self.conv1d.weight[:, 0]  # [C, kernel]

    def _request(self, x32, window, slot: int, prefix: int) -> torch.Tensor:
        """One request's rows [n, C] after its cached window (zeros for a fresh prompt)."""
        keep = self.kernel - 1
        past = window[slot] if prefix else window.new_zeros(window.shape[1:])
        inputs = torch.cat((past, x32))  # [kernel - 1 + n, C]
        window[slot] = inputs[inputs.shape[0] - keep:]
        # each row's window of kernel inputs, [n, C, kernel]: elementwise products rather
        # than a depthwise conv1d, whose CPU kernel is far slower at these sizes
        return (inputs.unfold(0, self.kernel, 1) * self._taps()).sum(-1)

    def _decode(self, x32, window, forward_batch) -> torch.Tensor:
        """One row per request [R, C], every window moved on by one."""
        slots = torch.tensor(forward_batch.req_slots, dtype=torch.long, device=x32.device)
        inputs = torch.cat((window[slots], x32[:, None]), dim=1)  # [R, kernel, C]
        window[slots] = inputs[:, 1:]
        return (inputs.transpose(1, 2) * self._taps()).sum(-1)


def _shape(t) -> str:
    """How an error names a state's tensor."""
    if not isinstance(t, torch.Tensor):
        return f"of type {type(t).__name__}"
    dtype = "" if t.dtype == torch.float32 else f"{t.dtype} "
    return f"{dtype}{list(t.shape)}"


class ShortConvUpdate:
    """``residual + conv(output)`` with the producer's ``ShortConv`` (``conv`` includes the
    output itself: ``y + conv(y)``).

    Args:
        conv: the producer's ``ShortConv`` (holding its layer's weights); None for a
            neighbour's description of the stage (``elsewhere``), which never applies it.
        name: its key in the cache's ``ShortConvState`` and what errors call it
            (``layer3.attn_sconv``).
    """

    plain = False
    portable = False  # it holds its layer's weights and its requests' windows
    at_producer = False
    reads_batch = True  # apply is handed the forward batch: its requests and their windows
    # the consumer applies it on each DP rank's own token rows, in order, in every row mode
    # and batch variant (its consumer's path is built to complete the output onto them)
    token_rows = True

    def __init__(self, conv: ShortConv | None, *, name: str) -> None:
        if conv is not None and not isinstance(conv, ShortConv):
            raise TypeError(f"ShortConvUpdate(conv={type(conv).__name__}): conv must be a "
                            "ShortConv (or None for a neighbour's description)")
        if not isinstance(name, str) or not name:
            raise TypeError(f"ShortConvUpdate(name={name!r}): name must be the non-empty key "
                            "of its windows in the cache's ShortConvState")
        self.conv, self.name = conv, name

    @classmethod
    def of(cls, layer, attr: str, index: int) -> ShortConvUpdate:
        """Layer ``index``'s convolution ``attr``: the layer's own module, or (``layer``
        None: a neighbour's declaration) a description that never runs."""
        name = f"layer{index}.{attr}"
        return cls(getattr(layer, attr) if layer is not None else None, name=name)

    def apply(self, residual: torch.Tensor | None, contribution: torch.Tensor,
              forward) -> torch.Tensor:
        """``residual + conv(contribution)`` over ``forward``'s requests (the ForwardBatch it
        runs in: its row order, prefixes and cache), the convolution's windows moved on."""
        if self.conv is None:
            raise RuntimeError(f"{self.name} holds another rank's weights: this short-"
                               "convolution update only describes a neighbour's stage")
        if forward is None:
            raise RuntimeError(f"{self.name}: {NO_FORWARD}")
        out = self.conv(contribution, state_of(forward, self.name), forward)
        if residual is None:
            return out
        acc = accumulate_dtype(residual.dtype)
        return (residual.to(dtype=acc) + out.to(dtype=acc)).to(dtype=residual.dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"
