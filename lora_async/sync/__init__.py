"""The senders: how a new adapter version gets from the learner into the generator.

`transports` holds the `Transport` protocol and the senders into an engine of this run (in
process, shared memory, CUDA IPC); `collective` (one broadcast over a process group),
`objectstore` (Ray's object store) and `http` (PEFT directories for remote servers) the others;
`factory.make_transport` picks one from the run's `[sync]`. `pack` packs a version into the
wire format of `handoff/`, which also holds the receiving halves.
"""
