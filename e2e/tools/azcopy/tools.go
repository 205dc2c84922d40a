//go:build tools

// Package tools pins the upstream commands this module builds; nothing here is compiled.
package tools

import _ "github.com/Azure/azure-storage-azcopy/v10"
