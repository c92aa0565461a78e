package main

import (
	"os"
	"strconv"
	"strings"
	"time"
)

// postgresCPU is the CPU time used so far by the local processes named
// postgres, read from /proc (Linux, a server on this machine); 0 elsewhere.
// Backends that exit between two readings are not counted.
func postgresCPU() time.Duration {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0
	}
	var ticks int64
	for _, e := range entries {
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		st := string(b)
		end := strings.LastIndexByte(st, ')')
		if !strings.Contains(st, "(postgres)") || end < 0 || end+2 > len(st) {
			continue
		}
		// After the command: state, then 10 fields, then utime and stime.
		f := strings.Fields(st[end+2:])
		if len(f) < 13 {
			continue
		}
		u, _ := strconv.ParseInt(f[11], 10, 64)
		s, _ := strconv.ParseInt(f[12], 10, 64)
		ticks += u + s
	}
	return time.Duration(ticks) * (time.Second / 100) // USER_HZ is 100 on Linux
}

// cpuUse is the CPU the bench process and the local PostgreSQL used during
// one measurement.
type cpuUse struct{ self, postgres time.Duration }

// measureCPU runs f and returns the CPU used meanwhile.
func measureCPU(f func() error) (cpuUse, error) {
	s0, p0 := processCPU(), postgresCPU()
	err := f()
	return cpuUse{processCPU() - s0, postgresCPU() - p0}, err
}
