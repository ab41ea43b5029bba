"""Benchmarks behind `lora-async bench`: figures are recorded in bench/RESULTS.md.

One module per command (`lora-async bench <command>`):

    sync               hot-swap latency of a new adapter version, per path
    gen                generation throughput, with and without LoRA, per set of CPU LoRA ops
    e2e                the training modes side by side on the same config and budget
    staleness          how much a stale sample teaches, per loss, at a controlled lag
    staleness_report   its report: steps and time to the target per arm, medians, the chart
    rewards            scoring throughput of a slow reward, beside a baseline checkout
    sandbox_cost       what the namespaced sandbox costs per call, beside the process runner
    fleet              a K-adapter fleet vs K separate runs
    replicas           `bench ray`: what Ray replicas cost on one machine

What they share:

    common             small helpers
    proc               processes and runs: ports, process groups, peak RSS, a run's summary
    run_json           one training from a resolved JSON config (a benchmark's child run)
    shared             one engine and one learner for many runs in one process
    snapshots          held-out accuracy of a run's saved adapters, scored after the run
    server             a training server on a loopback port, for tests and benchmarks
"""
