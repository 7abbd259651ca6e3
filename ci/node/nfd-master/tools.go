//go:build tools

// Package tools pins the node-feature-discovery module, whose nfd-master ci/build-nfd-master.sh builds
// unmodified (v0.18.3), together with the NodeFeature CRDs the same module ships.
package tools

import _ "sigs.k8s.io/node-feature-discovery/cmd/nfd-master"
