"""How versions are published: the :class:`~deltarl.pipeline.publisher.Publisher`'s settings, defined once.

The trainer's config file holds one under ``publish:``; code may pass one, or the same fields as
keyword arguments of ``Publisher(...)`` (they are validated through this model either way).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class PublishConfig(BaseModel):
    """How versions are published."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    keyframe_interval: int = Field(default=50, ge=1, description="a full snapshot every this many versions")
    digest_interval: int = Field(default=10, ge=1, description="a state digest in the manifest every this many versions")
    segment_bytes: int = Field(default=16 << 20, ge=1, description="target encoded size of a delta segment")
    segment_changes: int | None = Field(
        default=None, ge=1, description="at most this many changed elements per segment (None: the encoder's default)"
    )
    codec: str = Field(default="auto", description="chunk codec: 'auto' (chosen per chunk) or one codec's name")
    upload_workers: int = Field(default=4, ge=1, le=256, description="threads uploading segments while encoding goes on")
    max_in_flight: int | None = Field(
        default=None, ge=1, description="encoded segments queued or uploading at once (None: upload_workers + 2)"
    )
    lease_s: float = Field(default=300.0, gt=0, description="the writer claim's lease; renewed on every publish")
    takeover: bool = Field(default=False, description="take over the run from a writer whose claim has lapsed")
    digest_on_resume: bool = Field(
        default=False, description="record a state digest on the first version after a resume (a whole-state pass)"
    )
    piece_size: int = Field(
        default=1 << 20, ge=1 << 16, le=1 << 26, description="bytes per verified piece of every object (a power of two)"
    )
    cells: bool = Field(
        default=True,
        description="cut ctx-coded tensors into shard-grid cells so tensor/expert-parallel ranks read and stage only "
        "their part (False: a few % fewer bytes and faster whole-model staging, for runs whose actors hold whole tensors)",
    )
    segment_piece_size: int = Field(
        default=1 << 16, ge=1 << 16, le=1 << 26,
        description="bytes per verified piece of a delta segment: a tensor-parallel rank reads whole pieces of its part",
    )
    keyframe_part_bytes: int = Field(default=512 << 20, ge=1, description="target size of one keyframe part")
    serve_as: Literal["fp8-block128"] | None = Field(
        default=None,
        description="publish the state an engine serves: 'fp8-block128' quantizes each eligible 2-D weight to "
        "E4M3 codes plus 128x128 block scales (deltarl.codec.fp8); None publishes the state as given",
    )

    def with_settings(self, settings: Mapping[str, Any]) -> PublishConfig:
        """This config with ``settings`` (field names) replaced, validated again."""
        return self if not settings else PublishConfig.model_validate({**self.model_dump(), **settings})
