"""Cache-aware router across runtime replicas: one public endpoint (a replica's protocol), requests routed by the
longest resident prefix from each replica's KV events (router/index.py), health-checked replicas.

Public API: Router (router/router.py), RouterArgs (router/config.py), Policy (router/policy.py), ReplicaIndex
(router/index.py), RouterLauncher (router/launch.py).
"""
