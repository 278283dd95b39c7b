//! Markdown tables with a ratio row per peer: Tether's figure divided by the peer's.

use crate::bed::TETHER;

/// One cell: a figure, or words (a failure, "n/a", "yes"/"no").
#[derive(Debug, Clone)]
pub enum Cell {
    Num(f64),
    /// A count (no ratio).
    Int(u64),
    Text(String),
}

impl Cell {
    /// Words.
    pub fn text(s: impl Into<String>) -> Cell {
        Cell::Text(s.into())
    }

    fn show(&self, digits: usize) -> String {
        match self {
            Cell::Num(v) if v.is_finite() => format!("{v:.digits$}"),
            Cell::Num(_) => "-".into(),
            Cell::Int(n) => n.to_string(),
            Cell::Text(s) => s.clone(),
        }
    }
}

/// A table: a header, one row per peer, then `tether ÷ peer` rows.
pub struct Table {
    pub header: Vec<String>,
    pub rows: Vec<(String, Vec<Cell>)>,
    /// Digits after the point.
    pub digits: usize,
}

impl Table {
    /// An empty table with columns `header` (the first is the peer column).
    pub fn new(header: &[&str], digits: usize) -> Table {
        Table {
            header: header.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
            digits,
        }
    }

    /// Adds a peer's row.
    pub fn row(&mut self, peer: &str, cells: Vec<Cell>) {
        self.rows.push((peer.to_string(), cells));
    }

    /// The markdown, ratio rows included.
    pub fn render(&self) -> String {
        let mut s = format!(
            "| {} |\n|{}\n",
            self.header.join(" | "),
            "---|".repeat(self.header.len())
        );
        for (peer, cells) in &self.rows {
            let c: Vec<String> = cells.iter().map(|c| c.show(self.digits)).collect();
            s.push_str(&format!("| {peer} | {} |\n", c.join(" | ")));
        }
        let Some((_, t)) = self.rows.iter().find(|r| r.0 == TETHER) else {
            return s;
        };
        for (peer, cells) in self.rows.iter().filter(|r| r.0 != TETHER) {
            let c: Vec<String> = t
                .iter()
                .zip(cells)
                .map(|(a, b)| match (a, b) {
                    (Cell::Num(a), Cell::Num(b)) if *b > 0.0 && a.is_finite() && b.is_finite() => {
                        format!("{:.2}", a / b)
                    }
                    _ => "-".into(),
                })
                .collect();
            if c.iter().all(|x| x == "-") {
                continue;
            }
            s.push_str(&format!("| tether ÷ {peer} | {} |\n", c.join(" | ")));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_rows() {
        let mut t = Table::new(&["peer", "a", "b"], 1);
        t.row("direct", vec![Cell::Num(2.0), Cell::text("error")]);
        t.row("tether", vec![Cell::Num(1.0), Cell::Num(3.0)]);
        let r = t.render();
        assert!(r.contains("| direct | 2.0 | error |"), "{r}");
        assert!(r.contains("| tether ÷ direct | 0.50 | - |"), "{r}");
    }
}
