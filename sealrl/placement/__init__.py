"""Where roles run: in-process or on Ray, data-parallel training, dispatch and join by sample id.

Ray is imported only inside `workers.RayWorkerGroup` (an optional extra: `pip install sealrl[ray]`).
"""
