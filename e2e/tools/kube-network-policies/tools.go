//go:build tools

// Package tools pins the upstream commands this module builds; nothing here is compiled.
package tools

import _ "sigs.k8s.io/kube-network-policies/cmd"
