"""What the tests read of the local fleet beyond the product: its apiserver's audit log as records, a canary
run seen through it, and a snapshot of everything a run may touch. Never shipped."""
