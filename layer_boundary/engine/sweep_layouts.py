"""The layouts ``sweep`` runs: the parallel degrees, MoE dispatch, batch variant, boundary
policy and an idle attention-DP rank, as ``run``'s arguments; every one up to a world size."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

POLICIES = ("auto", "ar", "rs", "rsv")


@dataclass(frozen=True)
class Layout:
    """One layout the sweep tries: the parallel degrees, the MoE dispatch, the batch variant,
    the boundary policy, and whether an attention-DP rank gets no request."""

    tp: int
    dp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    a2a: bool = False
    sp: bool = False
    policy: str = "auto"
    empty: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def shape(self) -> tuple:
        """The layout without its policy: what the bytes are compared within."""
        return replace(self, policy="auto")

    def name(self) -> str:
        parts = [f"tp{self.tp}"] + [f"{k}{v}" for k, v in (("dp", self.dp), ("cp", self.cp),
                                                          ("pp", self.pp), ("ep", self.ep))
                                    if v > 1]
        parts += ["a2a"] * self.a2a + ["sp"] * self.sp + ["empty-dp"] * self.empty
        return " ".join(parts + [self.policy])

    def args(self) -> list[str]:
        """``run``'s arguments for it."""
        out = ["--tp", str(self.tp), "--dp", str(self.dp), "--cp", str(self.cp),
               "--pp", str(self.pp), "--ep", str(self.ep), "--boundary-reduction", self.policy]
        if self.a2a:
            out += ["--moe-a2a-backend", "all_to_all"]
        if self.sp:
            out.append("--sequence-parallel")
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(max_world: int, moe: bool, layers: int) -> list[Layout]:
    """Every layout to try, world sizes 1, 2, 4, ... up to ``max_world``, smallest first."""
    out, world = [], 1
    while world <= max_world:
        for pp in (p for p in _divisors(world) if p <= layers):
            tp = world // pp
            for dp, ep in itertools.product(_divisors(tp), [1, tp] if moe and tp > 1 else [1]):
                for cp in _divisors(tp // dp):
                    for a2a, sp in itertools.product((False, True) if ep > 1 else (False,),
                                                     (False, True) if tp > 1 else (False,)):
                        for policy in POLICIES if tp > 1 else ("auto",):
                            for empty in (False, True) if dp > 1 else (False,):
                                out.append(Layout(tp, dp, cp, pp, ep, a2a, sp, policy, empty))
        world *= 2
    return out
