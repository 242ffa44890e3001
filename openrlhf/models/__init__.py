"""OpenRLHF's `openrlhf.models` spellings: the remote reward server (`remote_rm`)."""
