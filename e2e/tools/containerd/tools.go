//go:build tools

// Builds containerd, its runc shim and ctr from the published containerd/v2 module (the
// real node's container runtime). containerd's go.mod has exclude lines, which `go install
// module@version` refuses, so this module requires it instead.
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
