"""How long one run of a collective takes on the links between its devices
(`collective_seconds`), for `_time`.

The model ("How to Scale Your Model", parts 2 and 3, for TPUs; a ring over
NVLink and InfiniBand, as NCCL runs it, for GPUs):

- A group of `n` devices spans `s` units (TPU slices over DCN, GPU hosts over
  InfiniBand) of `m = n / s` devices each. The collective runs inside each
  unit over its links, then between the units over the network on each
  device's `1/m` share of the array: `seconds = local + network`.
- The *array* is what one group holds in all: an all-gather's result, a
  reduce-scatter's input (`n` results), an all-reduce's or all-to-all's
  buffer. A ring moves `(k-1)/k` of it through each device over `k`
  devices, twice for an all-reduce.
- TPU ICI: the group's devices in one slice must fill a block of the torus
  (their coordinates along each physical axis, `k_d` of them, multiply to
  `m`), or be a pair (one route, of their distance in hops); each axis
  spanned gives one link one way, two where it has wraparound (the axis
  spans the slice's whole extent and that extent wraps: `Chip.wraps`). An
  all-to-all costs a quarter of an all-gather of its array (a
  bidirectional ring's mean distance). Latency: one hop per step of the
  ring, `k_d / 2` with wraparound.
- GPU NVLink: each GPU sends at its NVLink bandwidth (NVSwitch: any pair at
  full rate); a step per device of the ring.
- A permute sends its bytes over one link (the network between units); its
  hops are the distance between source and target on the torus.
- A transfer between TPU slices that the program states as a megascale
  `send`/`recv` pair (a `dcn` row): the same model over its groups of device
  ids; where its target names only slices (one device in each), the network
  part alone, `s` units of `m = 1` device.

Where the links are unknown (TPU devices without coordinates, a group that is
no block of the torus), `UnknownLinks` says so; nothing is guessed.
"""

import math
from collections.abc import Sequence
from typing import Any

from .._mesh._chips import Chip


class UnknownLinks(ValueError):
    """The links between a collective's devices are not known."""


def _unit(device: Any, chip: Chip) -> int:
    """The slice (TPU) or host (GPU) a device is in."""
    if chip.platform == "tpu":
        return int(getattr(device, "slice_index", 0) or 0)
    return int(device.process_index)


def _coords(device: Any) -> tuple[int, ...]:
    coords = getattr(device, "coords", None)
    if coords is None:
        raise UnknownLinks(
            f"the TPU device {device} has no coordinates on the torus, so the "
            "links between the devices of its collectives are not known"
        )
    return tuple(int(c) for c in coords)


def _ring(kind: str, k: int) -> float:
    """The fraction of the array a ring over `k` devices moves through each."""
    if k <= 1:
        return 0.0
    return (2.0 if kind == "all-reduce" else 1.0) * (k - 1) / k


def _array(kind: str, nbytes: int, n: int) -> float:
    return float(nbytes * n) if kind == "reduce-scatter" else float(nbytes)


class Links:
    """The links of a program's devices (`devices[i]`: the device of id `i`
    in the program's replica groups), on `chip`."""

    def __init__(self, devices: Sequence[Any], chip: Chip):
        self.devices, self.chip = list(devices), chip
        self.units = [_unit(d, chip) for d in self.devices]
        self.coords: list[tuple[int, ...]] = []
        self.extent: tuple[int, ...] = ()
        if chip.platform == "tpu":
            self.coords = [_coords(d) for d in self.devices]
            self.extent = tuple(max(c) + 1 for c in zip(*self.coords, strict=True))

    def seconds(self, kind: str, nbytes: int, groups: Sequence[Sequence[int]]) -> float:
        """One run of a collective of `kind` whose result is `nbytes` per
        device, over `groups` (a permute: source-target pairs): the slowest
        group's time."""
        if not groups or nbytes == 0:
            return 0.0
        if kind == "collective-permute":
            return max(self._pair(nbytes, a, b) for a, b in groups)
        worst, seen = 0.0, set()
        for group in groups:
            key = (len(group), len({self.units[i] for i in group}))
            if key in seen and self.chip.platform == "gpu":
                continue  # GPU groups of the same shape take the same time
            seen.add(key)
            worst = max(worst, self._group(kind, nbytes, list(group)))
        return worst

    def transfer_seconds(
        self, kind: str, nbytes: int, groups: Sequence[Sequence[int]], slices: int
    ) -> float:
        """One run of a transfer between TPU slices (`_hlo._megascale`) whose
        result is `nbytes` per device: over `groups` of device ids (a permute:
        pairs), or, without groups, between one device in each of `slices`
        slices, over DCN alone."""
        if not groups:
            if slices <= 1 or nbytes == 0:
                return 0.0
            network = _ring(kind, slices) * _array(kind, nbytes, slices)
            latency = (slices - 1) * self.chip.network_latency
            if kind == "all-reduce":
                latency *= 2
            return network / self.chip.network + latency
        position = {int(d.id): k for k, d in enumerate(self.devices)}
        for i in (i for group in groups for i in group):
            if i not in position:
                raise UnknownLinks(
                    f"a transfer between slices names the device id {i}, which "
                    "is not one of the program's devices"
                )
        return self.seconds(
            kind, nbytes, [[position[i] for i in group] for group in groups]
        )

    def _check(self, ids: Sequence[int]) -> None:
        if any(i >= len(self.devices) for i in ids):
            raise UnknownLinks(
                f"a collective names device {max(ids)} of a program of "
                f"{len(self.devices)} devices"
            )

    def _group(self, kind: str, nbytes: int, group: list[int]) -> float:
        self._check(group)
        n = len(group)
        units: dict[int, list[int]] = {}
        for i in group:
            units.setdefault(self.units[i], []).append(i)
        s = len(units)
        m = n // s
        array = _array(kind, nbytes, n)
        local = self._local(kind, array, next(iter(units.values())))
        if s == 1:
            return local
        network = _ring(kind, s) * array / m / self.chip.network
        latency = (s - 1) * self.chip.network_latency
        if kind == "all-reduce":
            latency *= 2
        return local + network + latency

    def _local(self, kind: str, array: float, ids: list[int]) -> float:
        """The time inside one unit, over the devices `ids`."""
        m = len(ids)
        if m <= 1:
            return 0.0
        chip = self.chip
        steps = 2 if kind == "all-reduce" else 1
        if chip.platform == "gpu":
            if kind == "all-to-all":
                return (m - 1) / m * array / m / chip.link + chip.link_latency
            return _ring(kind, m) * array / chip.link + steps * (m - 1) * (
                chip.link_latency
            )
        links, hops = self._block(ids)
        if kind == "all-to-all":
            # A quarter of an all-gather of the whole array.
            return (m - 1) / m * array / 4 / (chip.link * links) + hops * (
                chip.link_latency
            )
        return _ring(kind, m) * array / (chip.link * links) + steps * hops * (
            chip.link_latency
        )

    def _block(self, ids: list[int]) -> tuple[int, int]:
        """The links one way per device and the ring's hops of a group of
        TPU devices that fills a block of the torus."""
        coords = [self.coords[i] for i in ids]
        links = hops = 0
        spans = []
        for d, extent in enumerate(self.extent):
            k = len({c[d] for c in coords})
            spans.append(k)
            if k <= 1:
                continue
            wraps = k == extent and self.chip.wraps(extent)
            links += 2 if wraps else 1
            hops += k // 2 if wraps else k - 1
        if math.prod(spans) != len(ids) and len(ids) == 2:
            return 1, self._hops(ids[0], ids[1])  # a pair: one route
        if math.prod(spans) != len(ids):
            raise UnknownLinks(
                f"the {len(ids)} devices of a collective's group sit at torus "
                f"coordinates spanning {'x'.join(map(str, spans))} chips, which "
                "is no block of the torus, so its ring's links are not known. "
                "Build the mesh with eqshard.create_mesh(..., target=...), and "
                "if it was, put its axes in another order: the target's device "
                "order can spread one axis over the torus (a (4, 2) mesh of "
                "v5e:2x4 spreads its first axis; a (2, 4) mesh fills blocks)"
            )
        return max(links, 1), hops

    def _pair(self, nbytes: int, a: int, b: int) -> float:
        self._check((a, b))
        chip = self.chip
        if self.units[a] != self.units[b]:
            return nbytes / chip.network + chip.network_latency
        if chip.platform == "gpu":
            return nbytes / chip.link + chip.link_latency
        return nbytes / chip.link + self._hops(a, b) * chip.link_latency

    def _hops(self, a: int, b: int) -> int:
        """The hops between two TPU devices (at least one)."""
        hops = 0
        for d, extent in enumerate(self.extent):
            gap = abs(self.coords[a][d] - self.coords[b][d])
            if self.chip.wraps(extent):
                gap = min(gap, extent - gap)
            hops += gap
        return max(hops, 1)
