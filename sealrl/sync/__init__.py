"""Weight sync between the actor and rollout replicas: manifests, staging, verification."""
from sealrl.sync.manifest import TensorEntry, WeightManifest, WeightSyncError, build_manifest, verify_weights

__all__ = ["TensorEntry", "WeightManifest", "WeightSyncError", "build_manifest", "verify_weights"]
