// Stand-in for github.com/NVIDIA/go-nvfm v0.1.0, which the Go module proxy does not serve. The GPU kubelet
// plugin of sigs.k8s.io/dra-driver-nvidia-gpu reaches it only behind its Fabric Manager feature gate (off by
// default), through pkg/fabricmanager/client_nvfm.go: this module declares just the identifiers that file and
// its test use, and every call fails with LIBRARY_NOT_FOUND, as go-nvfm does on a host without libnvfm.so.
module github.com/NVIDIA/go-nvfm

go 1.22
