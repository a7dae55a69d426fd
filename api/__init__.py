"""tfps.api: the TrainingJob API and what it means, with no TensorFlow, gRPC, kopf or kubernetes.

- `spec`: the TrainingJob types and their defaults (pydantic), and reading a manifest;
- `naming`: every name that two parts of tfps must agree on (labels, ports, env vars, pod names);
- `tfconfig`: TF_CONFIG, written by the operator and `tfps local`, read by every replica;
- `semantics`: the TFJob rules as pure functions (replica order, success, restarts);
- `settings`: the TFPS_* environment a PS or worker process reads.

The runtime, the operator and `tfps local` all decide through these, so a manifest means the
same thing on every path.
"""
