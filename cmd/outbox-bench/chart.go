package main

import (
	"fmt"
	"image"
	"image/color"
	"image/png"
	"math"
	"os"
	"strconv"
	"time"
)

// series is one line of the latency chart.
type series struct {
	name   string
	color  color.RGBA
	points map[int]time.Duration // offered rate -> latency
}

// glyphs is a 3x5 pixel font for the chart's numbers and units.
var glyphs = map[rune][5]string{
	'0': {"###", "#.#", "#.#", "#.#", "###"}, '1': {".#.", "##.", ".#.", ".#.", "###"},
	'2': {"###", "..#", "###", "#..", "###"}, '3': {"###", "..#", "###", "..#", "###"},
	'4': {"#.#", "#.#", "###", "..#", "..#"}, '5': {"###", "#..", "###", "..#", "###"},
	'6': {"###", "#..", "###", "#.#", "###"}, '7': {"###", "..#", "..#", "..#", "..#"},
	'8': {"###", "#.#", "###", "#.#", "###"}, '9': {"###", "#.#", "###", "..#", "###"},
	'.': {"...", "...", "...", "...", ".#."}, 'm': {"...", "...", "###", "###", "#.#"},
	's': {"...", ".##", "#..", "..#", "##."}, '/': {"..#", "..#", ".#.", "#..", "#.."},
	'e': {"...", "###", "###", "#..", "###"}, 'v': {"...", "...", "#.#", "#.#", ".#."},
	'p': {"...", "###", "#.#", "###", "#.."}, ' ': {"...", "...", "...", "...", "..."},
}

func drawText(img *image.RGBA, x, y, scale int, s string, c color.RGBA) {
	for _, r := range s {
		g, ok := glyphs[r]
		if !ok {
			g = glyphs[' ']
		}
		for gy, row := range g {
			for gx, px := range row {
				if px == '#' {
					fillRect(img, x+gx*scale, y+gy*scale, scale, scale, c)
				}
			}
		}
		x += 4 * scale
	}
}

func fillRect(img *image.RGBA, x, y, w, h int, c color.RGBA) {
	for i := x; i < x+w; i++ {
		for j := y; j < y+h; j++ {
			img.SetRGBA(i, j, c)
		}
	}
}

func drawLine(img *image.RGBA, x0, y0, x1, y1, width int, c color.RGBA) {
	steps := max(abs(x1-x0), abs(y1-y0), 1)
	for i := 0; i <= steps; i++ {
		x := x0 + (x1-x0)*i/steps
		y := y0 + (y1-y0)*i/steps
		fillRect(img, x-width/2, y-width/2, width, width, c)
	}
}

func abs(v int) int {
	if v < 0 {
		return -v
	}
	return v
}

// writeLatencyChart draws latency (log scale, ms) against offered rate
// (events/s, one column per rate) for each series, with a legend of colour
// swatches in series order, and writes it as PNG.
func writeLatencyChart(path string, rates []int, ss []series) error {
	const (
		w, h                   = 900, 520
		left, right, top, bott = 110, 40, 40, 80
		scale                  = 3
	)
	img := image.NewRGBA(image.Rect(0, 0, w, h))
	fillRect(img, 0, 0, w, h, color.RGBA{255, 255, 255, 255})
	ink := color.RGBA{40, 40, 40, 255}
	grid := color.RGBA{220, 220, 220, 255}
	// y axis: 0.1 ms .. 10 s, log10.
	minL, maxL := math.Log10(0.1), math.Log10(10000)
	yOf := func(d time.Duration) int {
		ms := math.Max(float64(d)/float64(time.Millisecond), 0.1)
		f := (math.Log10(ms) - minL) / (maxL - minL)
		return top + int(float64(h-top-bott)*(1-math.Min(f, 1)))
	}
	for _, ms := range []float64{0.1, 1, 10, 100, 1000, 10000} {
		y := yOf(time.Duration(ms * float64(time.Millisecond)))
		drawLine(img, left, y, w-right, y, 1, grid)
		label := strconv.FormatFloat(ms, 'f', -1, 64) + "ms"
		drawText(img, left-10-len(label)*4*scale, y-7, scale, label, ink)
	}
	xOf := func(i int) int {
		if len(rates) == 1 {
			return (left + w - right) / 2
		}
		return left + 40 + i*(w-left-right-80)/(len(rates)-1)
	}
	for i, r := range rates {
		x := xOf(i)
		drawLine(img, x, top, x, h-bott, 1, grid)
		label := strconv.Itoa(r) + " ev/s"
		drawText(img, x-len(label)*2*scale, h-bott+12, scale, label, ink)
	}
	drawLine(img, left, top, left, h-bott, 2, ink)
	drawLine(img, left, h-bott, w-right, h-bott, 2, ink)
	for si, s := range ss {
		prevX, prevY := -1, -1
		for i, r := range rates {
			d, ok := s.points[r]
			if !ok {
				continue
			}
			x, y := xOf(i), yOf(d)
			fillRect(img, x-5, y-5, 10, 10, s.color)
			if prevX >= 0 {
				drawLine(img, prevX, prevY, x, y, 3, s.color)
			}
			prevX, prevY = x, y
		}
		// Legend: a swatch per series along the bottom, in order.
		fillRect(img, left+si*150, h-30, 40, 12, s.color)
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("chart: %w", err)
	}
	defer f.Close()
	return png.Encode(f, img)
}
