"""Several Prometheus sources shown as one: each metric family once, with every source's series labelled by source.

Used for `batchserve compare`'s root /metrics (both modes' registries, label `mode`) and for a replica's /metrics
behind the proxy (every ready replica's exposition text, label `replica`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric


class LabelledMerge:
    """A collector over `(source name, its metric families)` pairs: each sample gets `label=<source name>`
    (unchanged where it already has that label and value). `leading` families come first, as they are."""

    def __init__(
        self, sources: Iterable[tuple[str, Iterable[Metric]]], label: str, leading: Sequence[Metric] = ()
    ) -> None:
        self._sources = sources
        self._label = label
        self._leading = leading

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for source, source_families in self._sources:
            for family in source_families:
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                merged.samples.extend(s._replace(labels={**s.labels, self._label: source}) for s in family.samples)
        yield from self._leading
        yield from families.values()


def exposition(collector: LabelledMerge) -> bytes:
    """The collector's Prometheus text."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)  # type: ignore[arg-type]  # a duck-typed collector
    return generate_latest(registry)
