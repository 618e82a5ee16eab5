"""The node agent: a separate program that runs on each GPU node (a DaemonSet).

It reads every GPU and MIG device (NVML, or a DCGM exporter through Prometheus) and posts
samples to Tally's `/ingest/samples`. It needs no Django and no database: `python -m agent`.
"""
