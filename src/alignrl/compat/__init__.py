"""Other frameworks' spellings and the entry points their users already type: OpenRLHF's `train_ppo_ray` flags,
the DeepSpeed multi-node launcher with generation and reference services, the ZeroMQ pipeline's scripts. Each
translates flags into a config and hands it to the same commands as `alignrl`; the root-level scripts are shims
over these modules."""
