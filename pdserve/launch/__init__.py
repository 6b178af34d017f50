"""Starting a deployment: the `pdserve serve | router | worker` commands (their parsers `cli`, flag
tables `flags`, what they do `commands`), the local launcher (`local`: cores and GPUs per worker,
waiting for registration, one worker process; `procs`: the subprocesses, supervised and
restarted), the Ray launcher (`ray_launcher`, its actor `ray_actor`), and `serve --autoscale`'s
loop (`autoscale`). The only layer that imports both `pdserve.router` and `pdserve.serving`."""
