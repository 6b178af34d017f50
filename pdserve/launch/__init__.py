"""Starting a deployment: the `pdserve serve | router | worker` commands (flags in `cli`, what
they do in `commands`), the local launcher that runs the router and worker processes on this
machine (`local`), their supervision (`procs`), the Ray launcher that runs each worker as a Ray
actor (`ray_launcher`), and the autoscaling loop of `serve --autoscale` (`autoscale`). The only
layer that imports both `pdserve.router` and `pdserve.serving`."""
