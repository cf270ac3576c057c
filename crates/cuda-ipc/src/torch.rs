//! Interoperability with PyTorch's CUDA tensor sharing.
