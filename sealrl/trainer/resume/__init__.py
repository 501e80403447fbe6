"""The training position: what a checkpoint holds (weights, optimizer, sampler, the lane's
retained versions) and how a run resumes from it exactly."""
