package main

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/outboxkit/watermill-outbox/schema"
)

// Env reads the OUTBOX_* environment. Each accessor returns an error that
// names the variable and says what is expected.
type Env struct {
	getenv func(string) string
}

func (e Env) raw(name string) string { return strings.TrimSpace(e.getenv(name)) }

// String returns the variable or def when unset.
func (e Env) String(name, def string) string {
	if v := e.raw(name); v != "" {
		return v
	}
	return def
}

// Required returns the variable or an error naming it.
func (e Env) Required(name, example string) (string, error) {
	if v := e.raw(name); v != "" {
		return v, nil
	}
	return "", fmt.Errorf("%s is not set; set it, for example %s=%s", name, name, example)
}

// Bool parses true/false (and 1/0).
func (e Env) Bool(name string, def bool) (bool, error) {
	v := e.raw(name)
	if v == "" {
		return def, nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return false, fmt.Errorf("%s=%q is not a boolean; use true or false", name, v)
	}
	return b, nil
}

// Duration parses a Go duration such as 1s or 168h; allowZero permits 0.
func (e Env) Duration(name string, def time.Duration, allowZero bool) (time.Duration, error) {
	v := e.raw(name)
	if v == "" {
		return def, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 || (d == 0 && !allowZero) {
		return 0, fmt.Errorf("%s=%q is not a positive duration; use a value such as 1s, 1m or 168h", name, v)
	}
	return d, nil
}

// Int parses a positive integer.
func (e Env) Int(name string, def int) (int, error) {
	v := e.raw(name)
	if v == "" {
		return def, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("%s=%q is not a positive integer", name, v)
	}
	return n, nil
}

// Tables parses a comma-separated list of outbox tables.
func (e Env) Tables(name string, def []schema.Table) ([]schema.Table, error) {
	v := e.raw(name)
	if v == "" {
		return def, nil
	}
	var out []schema.Table
	seen := map[string]bool{}
	for _, part := range strings.Split(v, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		t, err := schema.ParseTable(part)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		if seen[t.Qualified()] {
			return nil, fmt.Errorf("%s lists %s twice", name, t.Qualified())
		}
		seen[t.Qualified()] = true
		out = append(out, t)
	}
	if len(out) == 0 {
		return nil, errors.New(name + " lists no table")
	}
	return out, nil
}

// with returns an Env where name reads value and every other variable
// reads as in e.
func (e Env) with(name, value string) Env {
	return Env{getenv: func(k string) string {
		if k == name {
			return value
		}
		return e.getenv(k)
	}}
}
