"""The offline tools over a finished run folder: `sealrl replay`, `sealrl recompute`, `sealrl eval`."""
