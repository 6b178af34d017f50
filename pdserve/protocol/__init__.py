"""The control-plane protocol between the router and the workers: typed messages
(`messages`) and the signed msgpack channel that carries them (`channel`). Imported by
`pdserve.router` and `pdserve.serving`; imports neither."""
