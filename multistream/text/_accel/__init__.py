"""Native kernels and fast decode paths of the text family (private)."""
