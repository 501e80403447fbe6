"""The experience record: identity, versions, typed batches, reward records, Parquet store.

Depends on torch, numpy, pyarrow and the standard library only.
"""
from sealrl.experience.batch import ExperienceBatch, ExperienceError, SampleMeta, Versioned, pad_token_rows
from sealrl.experience.fields import FIELDS, Align, FieldSpec, Kind
from sealrl.experience.ids import PolicyVersion, digest, group_id, sample_id, split_sample_id
from sealrl.experience.join import Join, LateResults, MissingResultsError, split_ids
from sealrl.experience.records import RewardRecord, RewardStatus, Role, SamplingContract, StopReason

__all__ = [
    "ExperienceBatch", "ExperienceError", "SampleMeta", "Versioned", "pad_token_rows", "FIELDS",
    "Align", "FieldSpec", "Kind", "PolicyVersion", "digest", "group_id", "sample_id",
    "split_sample_id", "Join", "LateResults", "MissingResultsError", "split_ids", "RewardRecord",
    "RewardStatus", "Role", "SamplingContract", "StopReason",
]
