"""The process foundation every layer above stands on: the process group of this run (torchrun or one process),
re-running a command under torchrun's agent, processes that die with their parent, and the one-line argument
parser. Imports nothing of the package above `config` and `errors`."""
