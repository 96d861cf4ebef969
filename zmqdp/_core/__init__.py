"""zmqdp's sans-IO core: the group's state machine (`state.GroupCore`) and its parts:
codec, handshake, routing, wave clock, request lifecycle, liveness, outboxes, CURVE
admission, metrics, and the wire interface (`wire.Wire`).

Plain synchronous code with no trio or zmq imports; time, where it matters, is passed
in as a value. The trio layer feeds it events and carries out what it returns, the way
trio-websocket drives wsproto. The package re-exports nothing: import from its modules.
"""
