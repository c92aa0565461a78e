package pgtest

import "testing"

// SetFreePort replaces the port picker of Start until the test ends.
func SetFreePort(t *testing.T, f func(testing.TB, string) int) {
	old := freePort
	freePort = f
	t.Cleanup(func() { freePort = old })
}
