"""Starting a deployment: the `pdserve serve | router | worker` commands (`cli`) and the local
launcher that runs the router and worker processes on this machine (`local`). The only layer
that imports both `pdserve.router` and `pdserve.serving`."""
