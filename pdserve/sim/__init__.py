"""Planner and simulator: should this deployment disaggregate, and with how many GPUs?

models.py      model presets and HF config.json loading (ModelSpec)
hardware.py    GPU and link presets with assumed price and power; the measured CPU from a
               profile (Accelerator, Link)
kvmath.py      KV bytes per token/prompt (GQA, MQA, MLA; fp32..int4), transfer times
kvsize.py      `pdserve kv-size` output
latency.py     roofline per forward pass with fitted efficiencies (LatencyModel)
profile.py     timing the real engine and fitting the efficiencies
calibration.py this machine's FLOP/s, bandwidths, and the profile JSON file; a cluster fitted
               to the speeds serving workers measure (`calibrated`)
deployment.py  what is simulated: Cluster (hardware, a Device per pool, model,
               ServingOverhead), Deployment (per-pool TP, EP, device; its cost and power)
overhead.py    the serving path's overhead, fitted to probe requests against a real server
served.py      the engine's efficiencies refitted to the steps a served engine logged
instance.py    one simulated engine instance: scheduling, decode stretches
fabric.py      KV transfer flows with shared bandwidth and layer-wise overlap
simulator.py   the discrete-event loop; bench-shaped records and aggregates
scaling.py     pools resized while it runs (a controller, start-up, drains); device-hours
scale_policy.py the autoscaler's settings (pool bounds, interval, cooldown), cheap to import
autoscale.py   the autoscaler's policy: P:D counts from observed load, by simulation
stats.py       percentiles of weighted samples (pooled inter-token latencies)
planner.py     the search behind `pdserve plan` (modes, shapes, hardware per pool, objective)
report.py      the plan's text and JSON, with reasons in numbers
cli.py         argparse registration (cheap); commands.py holds the handlers
"""
