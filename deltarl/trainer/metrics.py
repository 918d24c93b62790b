"""Prometheus metrics of the trainer and its publisher, on a registry of their own.

Publisher: versions committed (by kind), the latest version, delta and keyframe bytes, the changed
fraction, and how long encoding, uploading and committing took per version. Trainer: the step, its
reward, loss and KL, and the seconds spent training and waiting for results. The TRL integration uses
:meth:`TrainerMetrics.published` alone (``DeltaRLCallback(on_published=metrics.published)``).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: per-version encode / upload / commit seconds: milliseconds for a tiny model, tens of seconds for 8B
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
FRACTION_BUCKETS = (0.0001, 0.001, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class TrainerMetrics:
    """The trainer's and publisher's metrics; feed :meth:`published` each ``VersionInfo`` and :meth:`step`
    each ``StepReport``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "deltarl_publisher"
        self.versions = Counter(f"{p}_versions", "Versions committed, by kind", ["kind"], registry=r)
        self.version = Gauge(f"{p}_version", "Latest committed version", registry=r)
        self.version.set(-1)
        self.encoded_bytes = Counter(f"{p}_delta_bytes", "Encoded delta bytes uploaded", registry=r)
        self.keyframe_bytes = Counter(f"{p}_keyframe_bytes", "Keyframe bytes uploaded", registry=r)
        self.full_bytes = Gauge(f"{p}_full_bytes", "Bytes of one full BF16 state (what a delta replaces)", registry=r)
        self.changed = Gauge(f"{p}_changed_fraction", "Fraction of elements the latest version changed", registry=r)
        self.changed_hist = Histogram(f"{p}_changed_fraction_distribution", "Changed fraction per version",
                                      buckets=FRACTION_BUCKETS, registry=r)
        self.encode_s = Histogram(f"{p}_encode_seconds", "Encoding per version", buckets=SECONDS_BUCKETS, registry=r)
        self.upload_s = Histogram(f"{p}_upload_seconds", "Upload busy time per version (summed over the pool)",
                                  buckets=SECONDS_BUCKETS, registry=r)
        self.commit_s = Histogram(f"{p}_commit_seconds", "Manifest commit and HEAD swap per version",
                                  buckets=SECONDS_BUCKETS, registry=r)
        self.publish_s = Histogram(f"{p}_publish_seconds", "Whole publish call per version", buckets=SECONDS_BUCKETS,
                                   registry=r)
        t = "deltarl_trainer"
        self.step_gauge = Gauge(f"{t}_step", "Last finished training step", registry=r)
        self.reward = Gauge(f"{t}_reward_mean", "Mean reward of the last step's samples", registry=r)
        self.loss = Gauge(f"{t}_loss", "Loss of the last step", registry=r)
        self.kl = Gauge(f"{t}_kl", "KL to the reference of the last step", registry=r)
        self.train_s = Histogram(f"{t}_train_seconds", "Optimizer step seconds", buckets=SECONDS_BUCKETS, registry=r)
        self.wait_s = Histogram(f"{t}_wait_seconds", "Seconds waiting for a step's results", buckets=SECONDS_BUCKETS,
                                registry=r)
        self.stale = Counter(f"{t}_stale_samples", "Samples generated on the previous version (one-step async)",
                             registry=r)

    def published(self, info: Any) -> None:
        """Record one committed version (a publisher ``VersionInfo``)."""
        st = info.stats
        self.versions.labels(info.kind).inc()
        self.version.set(info.version)
        self.full_bytes.set(st.full_bytes)
        if info.version > 0:  # version 0 is the whole state, not a delta
            self.encoded_bytes.inc(st.encoded_bytes)
            self.changed.set(st.changed_fraction)
            self.changed_hist.observe(st.changed_fraction)
        self.keyframe_bytes.inc(info.keyframe_bytes)
        self.encode_s.observe(info.encode_s)
        self.upload_s.observe(info.upload_s)
        self.commit_s.observe(info.commit_s)
        self.publish_s.observe(info.wall_s)

    def step(self, report: Any) -> None:
        """Record one training step (a trainer ``StepReport``), its version included."""
        self.published(report.publish)
        s = report.stats
        self.step_gauge.set(report.step)
        self.reward.set(s.reward_mean)
        self.loss.set(s.loss)
        self.kl.set(s.kl)
        self.train_s.observe(s.seconds)
        self.wait_s.observe(report.wait_s)
        self.stale.inc(report.stale_samples)

    def render(self) -> bytes:
        return generate_latest(self.registry)
